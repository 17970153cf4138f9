"""Fault tolerance: the run's event log, restarts, hang watchdog, numerical guards, preemption, fault injection."""
