"""Cluster control: the group supervisor and `kvgrid serve`, which starts it all."""
