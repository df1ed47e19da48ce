"""The data plane: the request path from a client to an engine replica (auth, body cap, resolution,
choice of replica, accounting, hand-on and tagging), one module per generation shape, and the
copy process that serves it apart from the router's control plane."""
