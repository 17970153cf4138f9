"""megascale.perf"""
