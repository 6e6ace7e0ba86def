"""pagefleet operator: reconciles ModelDeployment resources into serving Deployments."""
