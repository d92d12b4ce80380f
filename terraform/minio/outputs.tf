locals {
  bucket_uri   = var.key_prefix == "" ? "s3://${minio_s3_bucket.run.bucket}" : "s3://${minio_s3_bucket.run.bucket}/${trimsuffix(var.key_prefix, "/")}"
  endpoint_url = var.public_endpoint_url != "" ? var.public_endpoint_url : "${var.minio_ssl ? "https" : "http"}://${var.minio_server}"
}

output "bucket_name" {
  description = "Name of the run bucket."
  value       = minio_s3_bucket.run.bucket
}

output "bucket_uri" {
  description = "What to pass as --bucket to vrl trainer and vrl volunteer."
  value       = local.bucket_uri
}

output "endpoint_url" {
  description = "What to pass as --endpoint-url (or VRL_ENDPOINT_URL)."
  value       = local.endpoint_url
}

output "trainer_access_key_id" {
  description = "AWS_ACCESS_KEY_ID of the trainer (the MinIO user name)."
  value       = minio_iam_user.trainer.name
}

output "trainer_secret_access_key" {
  description = "AWS_SECRET_ACCESS_KEY of the trainer."
  value       = minio_iam_user.trainer.secret
  sensitive   = true
}

output "volunteer_access_key_ids" {
  description = "AWS_ACCESS_KEY_ID of each volunteer, by volunteer name."
  value       = { for name, user in minio_iam_user.volunteer : name => user.name }
}

output "volunteer_secret_access_keys" {
  description = "AWS_SECRET_ACCESS_KEY of each volunteer, by volunteer name."
  value       = { for name, user in minio_iam_user.volunteer : name => user.secret }
  sensitive   = true
}

output "volunteer_env" {
  description = "A ready-to-source env file for each volunteer, by name (hand each one only its own)."
  sensitive   = true
  value = {
    for name, user in minio_iam_user.volunteer : name => join("\n", [
      "export AWS_ACCESS_KEY_ID=${user.name}",
      "export AWS_SECRET_ACCESS_KEY=${user.secret}",
      "export AWS_DEFAULT_REGION=${var.minio_region}",
      "export VRL_ENDPOINT_URL=${local.endpoint_url}",
      "# vrl volunteer --bucket ${local.bucket_uri} --id ${name}",
      "",
    ])
  }
}
