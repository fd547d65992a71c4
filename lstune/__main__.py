from lstune.cli.app import main

main()
