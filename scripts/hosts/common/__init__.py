"""What the host end-to-end runs share: the request set, the server wrapper, the probe."""
