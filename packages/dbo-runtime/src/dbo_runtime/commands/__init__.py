"""The subcommands of dbo-runtime, one click command (or group) per module, loaded lazily by `dbo_runtime.cli`:

- `reference`: the reference MoE model on local gloo ranks, DBO on or off (vLLM's flag names);
- `bench`: the benchmark of the runtime on the reference model;
- `compare run|collect|diff` (old name `ascend-compare`): the DBO on/off precision comparison;
- `doctor`: a vLLM-Ascend release checked for every hook site;
- `ascend-sites`: the hook-site table;
- `estimate`: when DBO pays, predicted from a model's config and hardware rates;
- `policy-table`: the table the `auto` split policy wrote (per shape class: verdict and step times).

Bad input is a usage error (one line, exit 2) found while the command line is parsed, before any work starts;
the parameter types shared by the commands are in `dbo_runtime.commands._params`.
"""
