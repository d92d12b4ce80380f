"""What people see of a run: `vrl status` (fleet and trainer at a glance) and the dashboard
(HTML and plots written into the bucket). Only reads the bucket, plus the dashboard's own
objects.

May import: protocol, storage and the shared modules. The trainer imports it to write the
dashboard at publish time, so it sits below trainer and volunteer.
"""
