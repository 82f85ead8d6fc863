from cosyvoice_build.cli import main

raise SystemExit(main())
