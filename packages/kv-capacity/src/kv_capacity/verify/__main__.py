"""`python -m kv_capacity.verify --child <vLLM engine args>`: the verification child (kv_capacity.verify.child)."""

import sys

if sys.argv[1:2] == ["--child"]:
    from kv_capacity.verify.child import main

    raise SystemExit(main(sys.argv[2:]))
print("usage: kv-capacity verify ... (this module's entry point is for the vLLM child process)", file=sys.stderr)
raise SystemExit(2)
