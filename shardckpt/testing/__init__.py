"""Test tooling shipped with the package: fault-injecting storage and the backend contract suite.

Third-party backends subclass the contract suite to prove they keep the storage rules.
"""
