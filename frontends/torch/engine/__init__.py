"""The pipeline engine: wire format, baton scheduling, leader/follower execution."""
