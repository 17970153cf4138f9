"""`megascale doctor`'s self-check: per-device matmul and per-group communication checks.

`measure` times one rank's work, `checks` runs the ordered list of checks on a
rank with a deadline per check, `detect` decides (pure functions) which ranks,
groups and links are slower than their peers or failing, `report` prints the
table and writes the JSON, and `runner` starts the ranks and collects their
results.
"""
