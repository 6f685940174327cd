"""``pagedserve bench``: measuring a running deployment (``pagedserve bench serve``)."""
