"""The routing brain: the prefix index, the cost policy, the router, its Ray actor and the event transport."""
