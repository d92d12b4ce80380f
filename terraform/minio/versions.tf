terraform {
  required_version = ">= 1.5.0"

  required_providers {
    minio = {
      source  = "aminueza/minio"
      version = ">= 3.39.0, < 4.0.0"
    }
  }
}

# Terraform talks to MinIO's admin API with the root (or an admin) account.
provider "minio" {
  minio_server   = var.minio_server
  minio_user     = var.minio_user
  minio_password = var.minio_password
  minio_ssl      = var.minio_ssl
  minio_region   = var.minio_region
}
