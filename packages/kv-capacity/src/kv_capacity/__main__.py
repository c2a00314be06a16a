from kv_capacity.cli import main

raise SystemExit(main())
