"""Tasks: what a task is (base.Task: dataset columns, prompt, reward, evaluation's "correct",
sampling suggestions, reward bounds), finding installed ones (registry: the entry-point group
volunteer_rl.tasks), running rewards under a task's bounds (bounded), reading a task's
dataset CSV (dataset) and the curriculum over its rows. vrl's own tasks: the calculator
(calculator_task, with its safe evaluator, reward rule and sentence generator) and countdown.

May import: protocol and the shared modules. Never torch or boto3.
"""
