from dbo_runtime.cli import main

raise SystemExit(main())
