"""The command line, one module per command family: `main` (the parser, `generate`, `serve`), `bench` (`paraspec
bench`, `paraspec profile`), `simulate` (`paraspec simulate`, `paraspec plan`), `study` (`paraspec study`)."""
