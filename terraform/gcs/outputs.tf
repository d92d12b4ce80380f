locals {
  path_suffix = var.key_prefix == "" ? "" : "/${trimsuffix(var.key_prefix, "/")}"
}

output "bucket_name" {
  description = "Name of the run bucket."
  value       = google_storage_bucket.run.name
}

output "bucket_uri" {
  description = "--bucket for native access through gcsfs (with a service account key)."
  value       = "gs://${google_storage_bucket.run.name}${local.path_suffix}"
}

output "s3_bucket_uri" {
  description = "--bucket for access through the S3-compatible API (with an HMAC key and s3_endpoint_url)."
  value       = "s3://${google_storage_bucket.run.name}${local.path_suffix}"
}

output "s3_endpoint_url" {
  description = "--endpoint-url for the S3-compatible API."
  value       = "https://storage.googleapis.com"
}

output "trainer_service_account_email" {
  description = "Service account of the trainer."
  value       = google_service_account.trainer.email
}

output "trainer_hmac_access_id" {
  description = "AWS_ACCESS_KEY_ID of the trainer for the S3-compatible API."
  value       = google_storage_hmac_key.trainer.access_id
}

output "trainer_hmac_secret" {
  description = "AWS_SECRET_ACCESS_KEY of the trainer for the S3-compatible API."
  value       = google_storage_hmac_key.trainer.secret
  sensitive   = true
}

output "trainer_service_account_key" {
  description = "Base64-encoded JSON key of the trainer service account (null when create_service_account_keys is false)."
  value       = var.create_service_account_keys ? google_service_account_key.trainer[0].private_key : null
  sensitive   = true
}

output "volunteer_service_account_emails" {
  description = "Service account of each volunteer, by volunteer name."
  value       = { for name, sa in google_service_account.volunteer : name => sa.email }
}

output "volunteer_hmac_access_ids" {
  description = "AWS_ACCESS_KEY_ID of each volunteer for the S3-compatible API, by volunteer name."
  value       = { for name, key in google_storage_hmac_key.volunteer : name => key.access_id }
}

output "volunteer_hmac_secrets" {
  description = "AWS_SECRET_ACCESS_KEY of each volunteer for the S3-compatible API, by volunteer name."
  value       = { for name, key in google_storage_hmac_key.volunteer : name => key.secret }
  sensitive   = true
}

output "volunteer_service_account_keys" {
  description = "Base64-encoded JSON key of each volunteer's service account, by volunteer name (empty when create_service_account_keys is false)."
  value       = { for name, key in google_service_account_key.volunteer : name => key.private_key }
  sensitive   = true
}

output "volunteer_env" {
  description = "A ready-to-source env file for each volunteer (S3-compatible API with HMAC), by name."
  sensitive   = true
  value = {
    for name, key in google_storage_hmac_key.volunteer : name => join("\n", [
      "export AWS_ACCESS_KEY_ID=${key.access_id}",
      "export AWS_SECRET_ACCESS_KEY=${key.secret}",
      "export AWS_DEFAULT_REGION=auto",
      "export VRL_ENDPOINT_URL=https://storage.googleapis.com",
      "# vrl volunteer --bucket s3://${google_storage_bucket.run.name}${local.path_suffix} --id ${name}",
      "",
    ])
  }
}
