from headstart.scripts.export.command import main

main()
