"""`python -m kv_capacity.tinymodels` and `from kv_capacity.tinymodels import ensure_model`, as other packages'
tests and skills call them: the generator is kv_capacity.testing.tinymodels."""

from kv_capacity.testing.tinymodels import (
    ARCHITECTURES,
    default_cache_dir,
    ensure_model,
    main,
    model_config,
    model_key,
)

__all__ = ["ARCHITECTURES", "default_cache_dir", "ensure_model", "main", "model_config", "model_key"]

if __name__ == "__main__":
    raise SystemExit(main())
