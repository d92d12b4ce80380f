locals {
  bucket_uri = var.key_prefix == "" ? "s3://${aws_s3_bucket.run.bucket}" : "s3://${aws_s3_bucket.run.bucket}/${trimsuffix(var.key_prefix, "/")}"
}

output "bucket_name" {
  description = "Name of the run bucket."
  value       = aws_s3_bucket.run.bucket
}

output "bucket_uri" {
  description = "What to pass as --bucket to vrl trainer and vrl volunteer."
  value       = local.bucket_uri
}

output "region" {
  description = "Region of the bucket (AWS_DEFAULT_REGION for trainer and volunteers)."
  value       = var.region
}

output "trainer_access_key_id" {
  description = "AWS_ACCESS_KEY_ID of the trainer."
  value       = aws_iam_access_key.trainer.id
}

output "trainer_secret_access_key" {
  description = "AWS_SECRET_ACCESS_KEY of the trainer."
  value       = aws_iam_access_key.trainer.secret
  sensitive   = true
}

output "volunteer_access_key_ids" {
  description = "AWS_ACCESS_KEY_ID of each volunteer, by volunteer name."
  value       = { for name, key in aws_iam_access_key.volunteer : name => key.id }
}

output "volunteer_secret_access_keys" {
  description = "AWS_SECRET_ACCESS_KEY of each volunteer, by volunteer name."
  value       = { for name, key in aws_iam_access_key.volunteer : name => key.secret }
  sensitive   = true
}

output "volunteer_env" {
  description = "A ready-to-source env file for each volunteer, by name (hand each one only its own)."
  sensitive   = true
  value = {
    for name, key in aws_iam_access_key.volunteer : name => join("\n", [
      "export AWS_ACCESS_KEY_ID=${key.id}",
      "export AWS_SECRET_ACCESS_KEY=${key.secret}",
      "export AWS_DEFAULT_REGION=${var.region}",
      "# vrl volunteer --bucket ${local.bucket_uri} --id ${name}",
      "",
    ])
  }
}
