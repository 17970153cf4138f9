"""megascale.optim"""
