"""megascale.distributed"""
