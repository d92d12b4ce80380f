"""The `vrl` command line, installed as the package volunteer_rl_cli: thin typer commands over
the volunteer_rl library.

main (the app), one module per command group (train, volunteer, observe, admin, tasks, demo),
options (the flags, made from the settings dataclasses of volunteer_rl/config.py) and errors
(how a failure ends a command).
"""
