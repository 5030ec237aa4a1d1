terraform {
  # Built-ins only (terraform_data + local-exec): no provider to install, so the
  # module works without registry access. 1.5 is the floor for terraform_data.
  required_version = ">= 1.5"
}
