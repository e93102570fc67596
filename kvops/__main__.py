from kvops.cli import main

raise SystemExit(main())
