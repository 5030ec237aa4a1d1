"""Existing hosts (`infra: ssh/INVENTORY`): nothing to provision; the inventory file is the cluster."""
