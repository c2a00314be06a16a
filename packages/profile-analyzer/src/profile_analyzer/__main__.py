from profile_analyzer.cli import main

raise SystemExit(main())
