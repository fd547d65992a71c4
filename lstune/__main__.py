from lstune.cli.app import entry

entry()
