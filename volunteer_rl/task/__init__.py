"""The calculator task: the safe evaluator of Python arithmetic, the reward, the dataset CSVs
and the sentence generator that made them (a data tool, never imported at run time), and the
curriculum that picks the prompts of each version's pool.

May import: the shared modules only. Never torch or boto3.
"""
