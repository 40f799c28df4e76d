from elbowroom.cli import main

raise SystemExit(main())
