"""`megascale report RUN_DIR`: pictures and a merged timeline of a run, written to RUN_DIR/report/."""
