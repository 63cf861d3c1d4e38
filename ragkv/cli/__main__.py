from ragkv.cli import main

main()
