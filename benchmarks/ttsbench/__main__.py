from ttsbench.cli import main

raise SystemExit(main())
