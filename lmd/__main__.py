from lmd.cli import main

main()
