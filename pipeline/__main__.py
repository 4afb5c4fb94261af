from stages.cli import main

main()
