from paritykit.cli import main

main()
