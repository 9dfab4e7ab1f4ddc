from titan.cli import main

main()
