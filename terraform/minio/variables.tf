variable "minio_server" {
  description = "host:port of the MinIO S3 API as seen from where terraform runs (no scheme), e.g. localhost:9000."
  type        = string
  default     = "localhost:9000"
}

variable "minio_ssl" {
  description = "Whether terraform reaches minio_server over HTTPS."
  type        = bool
  default     = false
}

variable "minio_user" {
  description = "MinIO root (or admin) user used by terraform; set it with TF_VAR_minio_user."
  type        = string
  sensitive   = true
}

variable "minio_password" {
  description = "Password of minio_user; set it with TF_VAR_minio_password."
  type        = string
  sensitive   = true
}

variable "minio_region" {
  description = "Region MinIO is configured with (MINIO_REGION, us-east-1 unless set)."
  type        = string
  default     = "us-east-1"
}

variable "public_endpoint_url" {
  description = "URL volunteers use to reach MinIO over the internet, e.g. https://s3.example.org (put TLS in front of MinIO). Empty: derived from minio_server and minio_ssl."
  type        = string
  default     = ""

  validation {
    condition     = var.public_endpoint_url == "" || can(regex("^https?://[^/]+$", var.public_endpoint_url))
    error_message = "public_endpoint_url must be empty or look like https://host[:port] (no path)."
  }
}

variable "bucket_name" {
  description = "Bucket name for the run (the rendezvous bucket)."
  type        = string
  default     = "vrl"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name (3-63 chars, lowercase letters, digits, dots, hyphens)."
  }
}

variable "key_prefix" {
  description = "Optional key prefix inside the bucket (\"\" or something like \"runs/calc/\")."
  type        = string
  default     = ""

  validation {
    condition     = var.key_prefix == "" || can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*/$", var.key_prefix))
    error_message = "key_prefix must be empty or look like \"a/b/\": no leading slash, a trailing slash, no wildcards."
  }
}

variable "name_prefix" {
  description = "Prefix of the MinIO user and policy names this module creates (the user name is the access key)."
  type        = string
  default     = "vrl"

  validation {
    condition     = can(regex("^[A-Za-z0-9_-]{1,16}$", var.name_prefix))
    error_message = "name_prefix must be 1-16 letters, digits, hyphens or underscores."
  }
}

variable "volunteers" {
  description = "Names of the volunteers. Each gets its own MinIO user and policy scoped to rollouts/*/NAME/ and volunteers/NAME.json. The name is the --id the volunteer must run with. Remove a name and apply to revoke that volunteer."
  type        = set(string)
  default     = []

  validation {
    condition     = alltrue([for v in var.volunteers : can(regex("^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$", v))])
    error_message = "Each volunteer name must be 1-20 characters: lowercase letters, digits and inner hyphens."
  }
}

variable "rollout_expiration_days" {
  description = "Delete rollout shards (rollouts/) this many days after upload."
  type        = number
  default     = 14

  validation {
    condition     = var.rollout_expiration_days >= 1
    error_message = "rollout_expiration_days must be at least 1."
  }
}

variable "checkpoint_expiration_days" {
  description = "Delete checkpoint files (checkpoints/) this many days after upload; 0 keeps them forever. Set it well above the longest pause of a run: the checkpoint the manifest points to must not expire."
  type        = number
  default     = 0

  validation {
    condition     = var.checkpoint_expiration_days >= 0
    error_message = "checkpoint_expiration_days must be 0 (keep) or more."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Delete overwritten or deleted object versions this many days after they stop being current."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "force_destroy" {
  description = "Allow terraform destroy to delete a bucket that still holds objects."
  type        = bool
  default     = false
}
