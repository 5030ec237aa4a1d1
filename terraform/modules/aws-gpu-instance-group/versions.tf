terraform {
  # The module runs on 1.5+; its tests (mock_provider, override_during) need 1.11+.
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.74 added interface_type = "efa-only" to launch templates.
      version = ">= 5.74, < 7"
    }
  }
}
