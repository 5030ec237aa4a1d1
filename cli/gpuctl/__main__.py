from gpuctl.clistart import main

main()
