"""Beyond one process: engine replicas on Ray Serve behind one ingress, routed by cached prefix and KV memory."""
