"""The node agent: plays kubelet for a set of Nodes, running each pod's containers as local
processes (see :mod:`~spotrl_e2e.nodeagent.pods`) and exposing failure modes through a
control channel (see :mod:`~spotrl_e2e.nodeagent.agent`)."""
