"""SpotRL's test control plane: real Kubernetes and S3 servers on loopback, without Docker.

- :mod:`spotrl_e2e.s3` runs versitygw (an S3-compatible server) on a folder.
- :mod:`spotrl_e2e.pki` makes the cluster's certificates and service-account keys.
- :mod:`spotrl_e2e.controlplane` runs etcd, kube-apiserver, kube-controller-manager and
  kube-scheduler.
- :mod:`spotrl_e2e.nodeagent` plays kubelet for a set of Nodes: pods run as local processes.
- :mod:`spotrl_e2e.kubecluster` has what any test cluster offers through the API and kubectl
  (``KubeCluster``: clients, namespaces, pods, cordon, taint, evict, drain), the base of
  ``Cluster`` and of the kind harness (``e2e/kind/kind_cluster.py``).
- :mod:`spotrl_e2e.cluster` puts them together (``Cluster``) with helpers for the failure
  modes of spot nodes, and a CLI (``python -m spotrl_e2e.cluster up|down``).
- :mod:`spotrl_e2e.pytest_plugin` has the fixtures (``s3_bucket``, ``cluster``, ``namespace``).
"""
