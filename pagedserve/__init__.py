"""pagedserve: the distribution's namespace for generated API stubs (``pagedserve.v1``)."""
