"""DistributedTrainingJob has no handler of its own: its reconcile is controller.py's, woken by
the routing in handlers/indexes.py whenever the job or one of its children changes. This module
stays so the list of resources in main.py reads the same; it registers nothing."""
