"""Deployment helpers that run beside the SGLang servers (docker/compose.turns.yaml, deploy/k8s):
stdlib only, so they run in the gateway's image and in SGLang's."""
