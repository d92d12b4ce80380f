"""The `vrl` command line (installed as the package volunteer_rl_cli)."""
