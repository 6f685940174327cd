"""The gateway: the public streaming API in front of the executors."""
