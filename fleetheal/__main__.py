from fleetheal.cli import main

raise SystemExit(main())
