"""`python -m volunteer_rl_cli`: the same as `vrl`."""

from volunteer_rl_cli.main import main

main()
