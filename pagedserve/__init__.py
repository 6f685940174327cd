"""pagedserve: the distribution's namespace for the generated API stubs (``pagedserve.v1``) and
the tools beside the services (``pagedserve.tools``)."""
